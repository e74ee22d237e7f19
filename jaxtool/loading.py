"""Load a user's function and its inputs: :func:`load`, :func:`load_target` and :func:`resolve`.

Targets
    ``path/to/file.py:QUALNAME`` or ``package.module:QUALNAME`` (or, from Python, a callable).
    QUALNAME may be dotted: ``model.apply`` (an attribute of a module-level object),
    ``Model.create`` (a static or class method), ``Model.loss`` (an instance method: the
    class is instantiated with no arguments). A plain file is imported with its folder on
    ``sys.path``, so sibling imports work; a file inside a package (its folder has an
    ``__init__.py``) is imported as part of that package (the folder above the outermost
    ``__init__.py`` goes on ``sys.path``), so relative imports work. A module target is
    imported with the working directory on ``sys.path``, as ``python -m`` does.

Inputs
    Each positional spec fills one positional array parameter, in order; parameters after
    the last spec keep their Python defaults. ``static`` (``--static NAME=VALUE``) binds
    parameters by name; they are not array arguments. ``inputs`` is an ``.npz`` file with
    one array per argument, ``arg0``, ``arg1``, ... (checked against the specs when both
    are given). Without specs and without ``inputs`` the arguments come from the user's
    file; the first rule that applies wins:

    1. the whole argument tuple: a companion ``NAME_example_args()`` next to the function
       (in the module for a top-level function, in the class for a method), else an
       attribute ``example_args`` on the function; either may be a tuple or a
       zero-argument callable returning one;
    2. each positional parameter on its own: an array-like default value (arrays, Python
       numbers, which become arrays of the default float dtype, or pytrees of these), else
       a spec annotation (``x: "f32[3,4]"``), else a jaxtyping annotation with fixed
       sizes (``Float[Array, "3 4"]``, when jaxtyping is installed); a parameter with any
       other default (``None``, a string, a bool) keeps it and is not an array argument;
    3. otherwise a :class:`UsageError` names the parameter.

    Shapes without values (specs, annotations, ``ShapeDtypeStruct`` leaves in example
    arguments) get values drawn from ``numpy.random.default_rng(seed)`` (floats ~ N(0, 1),
    integers in [0, 10), fair booleans); :attr:`Loaded.drawn` says so.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxtool.errors import JaxtoolError, LoadError, SpecError, UsageError
from jaxtool.source import code_file, display_path, exception_message, location_of_exception, unwrap, wrapper_chain
from jaxtool.specs import check_x64, draw, drawn_kind, format_spec, parse_spec, parse_statics, \
    resolve_annotation, spec_of_annotation


#: How :func:`jaxtool.specs.draw` draws each kind of value, as the note on stderr says it.
DRAWN_KINDS = {"floats": "floats from N(0,1)", "complex": "complex numbers with N(0,1) parts",
               "integers": "integers from [0, 10)", "booleans": "booleans by coin flip"}


@dataclass
class Loaded:
    """A loaded target: a function of array arguments and the arguments to call it with."""

    fn: Callable
    """Takes exactly the array arguments, positionally (static arguments already bound)."""
    args: tuple
    """One value per array argument: arrays or pytrees of arrays (``ShapeDtypeStruct`` with ``concrete=False``)."""
    arg_names: list[str]
    """The parameter name of each argument (``args[0]``, ... for extra ``*args``)."""
    obj: object
    """The raw object the target names: a function, method, callable object, or jaxpr."""
    source_file: str | None
    """Absolute path of the file that defines the function (or of the target's module)."""
    drawn: tuple = ()
    """The kinds of argument values drawn at random, of :data:`DRAWN_KINDS` (see the module docstring)."""
    annotations: dict = field(default_factory=dict)
    """Parameter name (and ``"return"``) -> a ``ShapeDtypeStruct`` pytree parsed from a spec annotation, or the
    jaxtyping annotation itself."""
    name: str = ""
    """The target's qualified name, for messages."""
    narrowed: tuple = ()
    """The ``--inputs`` arrays (given without specs) taken at a narrower dtype because 64-bit mode
    is off, as ``"arg0 (f64[3])"``."""

    def notes(self, seed: int) -> list[str]:
        """The notes a command prints on stderr about where the argument values came from."""
        if self.drawn == ("floats",):
            found = [f"note: inputs drawn from N(0,1) with seed {seed}"]
        elif self.drawn:
            found = [f"note: inputs drawn with seed {seed}: " + ", ".join(DRAWN_KINDS[k] for k in self.drawn)]
        else:
            found = []
        if self.narrowed:
            found.append(f"note: --inputs {', '.join(self.narrowed)} taken at 32 bits: 64-bit mode is off "
                         "(pass --x64 to keep 64 bits)")
        return found


@dataclass
class _Resolved:
    obj: object
    parent: object  # what the last name was looked up on; None for a callable given directly
    name: str
    source_file: str | None


def resolve(target) -> object:
    """The raw object ``target`` names (imported, not called); a non-string target is returned as is."""
    return _resolve(target).obj


def load(target, *specs, inputs=None, seed: int = 0, static=None) -> tuple[Callable, tuple]:
    """``(fn, args)`` for ``target``: ``fn(*args)`` runs the user's function (see :func:`load_target`)."""
    import numpy as np

    # (the CLI's options are checked by click)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"seed={seed!r}: expected an integer >= 0")
    if inputs is not None and not isinstance(inputs, (str, os.PathLike)):
        raise UsageError(f"inputs={inputs!r}: expected the path of an .npz file")
    loaded = load_target(target, specs, inputs=inputs, seed=seed, static=static)
    return loaded.fn, loaded.args


def load_target(target, specs=(), *, inputs=None, seed: int = 0, static=None, concrete: bool = True) -> Loaded:
    """Import ``target`` and work out its array arguments (rules in the module docstring).

    ``specs`` are spec strings (``"f32[3]"``, pytree JSON) or already-built values
    (``ShapeDtypeStruct`` or array pytrees). ``static`` is a mapping or ``NAME=VALUE`` strings.
    ``inputs`` is an ``.npz`` path. With ``concrete=False`` shapes stay ``ShapeDtypeStruct``
    instead of being drawn. Raises :class:`LoadError` (import, lookup) and
    :class:`UsageError` (specs, counts, inputs).
    """
    import numpy as np

    resolved = _resolve(target)
    fn = _as_function(resolved)
    static = parse_statics(static)
    sig = _signature(fn)
    positional, varargs = _parameters(sig, static, resolved.name)
    namespace = _namespace(fn)
    if isinstance(specs, str):
        specs = (specs,)

    narrowed = ()
    if specs or inputs is not None:
        values = [parse_spec(s) if isinstance(s, str) else s for s in specs]
        if inputs is not None:
            values, narrowed = _read_inputs(inputs, values)
            if not specs:
                _refuse_pytree_parameters(resolved, positional[:len(values)], namespace, inputs)
        given = (f"{_plural(len(values), 'spec')} {'was' if len(values) == 1 else 'were'} given" if specs
                 else f"--inputs has {_plural(len(values), 'array')}")
        _check_count(len(values), positional, varargs, resolved.name, given)
        chosen = positional[:len(values)]
    else:
        example = _example_args(resolved)
        if example is not None:
            values, label = example
            _check_count(len(values), positional, varargs, resolved.name,
                         f"{label} has {_plural(len(values), 'argument')}")
            chosen = positional[:len(values)]
        else:
            chosen, values = _infer(positional, namespace, resolved.name)

    args, drawn = _realize(values, np.random.default_rng(seed), concrete)
    extras = len(args) - len(chosen)
    bound = _bind(fn, sig, chosen, varargs if extras else None, static, resolved.name)
    names = [p.name for p in chosen] + [f"{varargs.name}[{i}]" for i in range(extras)]
    return Loaded(fn=bound, args=tuple(args), arg_names=names, obj=resolved.obj,
                  source_file=resolved.source_file, drawn=drawn,
                  annotations=_annotations(sig, namespace), name=resolved.name, narrowed=narrowed)


# --- resolving targets --------------------------------------------------------------------------


def _resolve(target) -> _Resolved:
    if not isinstance(target, str):
        name = getattr(target, "__qualname__", None) or type(target).__name__
        file = code_file(target)
        return _Resolved(target, None, name, os.path.abspath(file) if file else None)
    where, sep, qualname = target.rpartition(":")
    if not sep or not where.strip() or not qualname.strip():
        raise UsageError(f"bad target {target!r}: expected FILE.py:NAME or MODULE:NAME, e.g. model.py:loss")
    if where.endswith(".py") or "/" in where or os.sep in where:
        module = _import_file(where)
    else:
        if not all(part.isidentifier() for part in where.split(".")):
            raise UsageError(f"bad target {target!r}: {where!r} is neither a .py file nor a module name")
        _add_path(os.getcwd())
        module = _current(_import_module(where, where), where)
    obj, parent = _lookup(module, qualname, where)
    file = code_file(obj) or getattr(module, "__file__", None)
    return _Resolved(obj, parent, qualname, os.path.abspath(file) if file else None)


def _add_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()


def _same_file(a: str | None, b: str) -> bool:
    return bool(a) and os.path.exists(a) and os.path.samefile(a, b)


#: absolute path -> (modification time, size) of each file jaxtool imported as it was then: a
#: later load of a target in a file changed since imports it again (``jaxtool.load`` in a
#: notebook after an edit), where Python's import would return the module it has
_STAMPS: dict = {}


def _stamp(path: str) -> tuple:
    status = os.stat(path)
    return status.st_mtime_ns, status.st_size


def _changed(path: str) -> bool:
    """Whether ``path`` changed since jaxtool imported it (False for a file it did not import)."""
    return path in _STAMPS and _STAMPS[path] != _stamp(path)


@contextlib.contextmanager
def _stamping_imports():
    """Within: the files of the modules imported (a target's siblings) get their stamps, so that a
    later load of one of them as a target sees an edit made since."""
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            path = getattr(sys.modules.get(name), "__file__", None)
            if path and os.path.isfile(path):
                _STAMPS.setdefault(os.path.abspath(path), _stamp(path))


def _current(module: types.ModuleType, where: str) -> types.ModuleType:
    """``module`` (imported by name), imported again where its file changed since jaxtool first saw it."""
    path = getattr(module, "__file__", None)
    if not path or not os.path.isfile(path):
        return module
    path = os.path.abspath(path)
    if _changed(path):
        with contextlib.suppress(OSError):  # its bytecode: an edit within the second, of the same size, passes
            os.remove(importlib.util.cache_from_source(path))  # Python's check of it (mtime in seconds, size)
        with _import_errors(where, module.__name__), _stamping_imports():
            module = importlib.reload(module)
    _STAMPS[path] = _stamp(path)
    return module


def _import_file(where: str) -> types.ModuleType:
    path = os.path.abspath(where)
    if not os.path.exists(path):
        raise LoadError(f"no such file: {where}")
    if os.path.isdir(path):
        raise LoadError(f"{where} is a directory; give a .py file or a module name")
    if not path.endswith(".py"):
        raise LoadError(f"{where} is not a Python file (.py)")
    folder = os.path.dirname(path)
    stem = os.path.basename(path)[:-3]
    parts = [] if stem == "__init__" else [stem]
    root = folder
    while os.path.isfile(os.path.join(root, "__init__.py")) and os.path.basename(root).isidentifier():
        parts.insert(0, os.path.basename(root))
        root = os.path.dirname(root)
    if root != folder and all(part.isidentifier() for part in parts):
        _add_path(root)
        name = ".".join(parts)
        module = _import_module(name, where)
        if not _same_file(getattr(module, "__file__", None), path):
            raise LoadError(f"cannot import {where} as {name}: that name is already taken by "
                            f"{display_path(str(getattr(module, '__file__', None)))}")
        return _current(module, where)
    _add_path(folder)
    return _exec_file(path, stem, where)


def _exec_file(path: str, stem: str, where: str) -> types.ModuleType:
    """Import a plain file as module ``stem`` (or a private name when ``stem`` is taken by another file)."""
    name = stem
    if name in sys.modules and not _same_file(getattr(sys.modules[name], "__file__", None), path):
        name = "_jaxtool_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    existing = sys.modules.get(name)
    if existing is not None and _same_file(getattr(existing, "__file__", None), path) and not _changed(path):
        _STAMPS.setdefault(path, _stamp(path))  # (imported otherwise: an edit from now on is seen)
        return existing
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    stamp = _stamp(path)  # (before running it: a change made while it runs is seen next time)
    try:
        with _import_errors(where, name), _stamping_imports():
            # compiled from the source, not from bytecode Python may have cached: its check (mtime in
            # seconds, size) passes an edit of the same size within the second
            exec(spec.loader.source_to_code(spec.loader.get_data(path), path), module.__dict__)
    except BaseException:
        if existing is not None:
            sys.modules[name] = existing
        else:
            sys.modules.pop(name, None)
        raise
    _STAMPS[path] = stamp
    return module


def _import_module(name: str, where: str) -> types.ModuleType:
    with _import_errors(where, name), _stamping_imports():
        return importlib.import_module(name)


@contextlib.contextmanager
def _import_errors(where: str, module_name: str):
    """Turn an exception raised while importing ``module_name`` into a one-line :class:`LoadError`."""
    try:
        yield
    except JaxtoolError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise LoadError(f"no module named {exc.name!r} (is it installed, or on PYTHONPATH?)") from exc
        raise LoadError(f"{exception_message(exc)} (while importing {where})",
                        location=location_of_exception(exc)) from exc
    except SyntaxError as exc:
        elsewhere = exc.filename and os.path.isfile(where) and not _same_file(exc.filename, where)
        raise LoadError(f"{type(exc).__name__}: {exc.msg}" + (f" (while importing {where})" if elsewhere else ""),
                        location=location_of_exception(exc)) from exc
    except (Exception, SystemExit, GeneratorExit) as exc:  # (not KeyboardInterrupt)
        raise LoadError(f"{exception_message(exc)} (while importing {where})",
                        location=location_of_exception(exc)) from exc


def _lookup(module, qualname: str, where: str):
    """Walk the dotted ``qualname`` from ``module``; returns (object, the object it was found on)."""
    obj, parent, done = module, None, []
    for part in qualname.split("."):
        if not part.isidentifier():
            raise UsageError(f"bad target name {qualname!r}: expected a dotted Python name such as Model.loss")
        if inspect.isclass(obj) and isinstance(inspect.getattr_static(obj, part, None), types.FunctionType):
            obj = _instantiate(obj, ".".join(done), part, where)
        try:
            value = getattr(obj, part)
        except AttributeError:
            raise LoadError(_missing_message(obj, done, part, where)) from None
        except Exception as exc:
            raise LoadError(f"looking up {'.'.join([*done, part])} in {where} raised {exception_message(exc)}",
                            location=location_of_exception(exc)) from exc
        parent, obj = obj, value
        done.append(part)
    return obj, parent


def _instantiate(cls, class_name: str, method: str, where: str):
    try:
        return cls()
    except Exception as exc:
        raise LoadError(f"{class_name}.{method} is an instance method and {class_name}() failed "
                        f"({exception_message(exc)}); target an instance instead, e.g. obj.{method} with "
                        f"obj = {class_name}(...) in {where}") from exc


def _missing_message(obj, done: list[str], part: str, where: str) -> str:
    prefix = "".join(f"{d}." for d in done)
    names = [n for n in dir(obj) if not n.startswith("_")]
    message = f"name {prefix + part!r} not found in {where}"
    close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
    if close:
        return message + "; did you mean " + " or ".join(repr(prefix + c) for c in close) + "?"
    available = [n for n in names if callable(getattr(obj, n, None)) and not inspect.ismodule(getattr(obj, n))]
    if available:
        shown = ", ".join(available[:8]) + (", ..." if len(available) > 8 else "")
        return message + f" (callables there: {shown})"
    return message


def _as_function(resolved: _Resolved) -> Callable:
    """The callable to trace: the object itself, or a function evaluating a jaxpr object."""
    import jax
    from jax.extend import core as jex

    obj = resolved.obj
    if isinstance(obj, jex.Jaxpr):
        if obj.constvars:
            raise LoadError(f"{resolved.name} is a Jaxpr with constants; give the ClosedJaxpr instead")
        obj = jex.ClosedJaxpr(obj, [])
    if isinstance(obj, jex.ClosedJaxpr):
        run = jex.jaxpr_as_fun(obj)
        avals = obj.in_avals

        def jaxpr_fn(*args):
            # (evaluating a jaxpr at other shapes can run, as an elementwise one does: its types are fixed)
            given = [jax.typeof(x) for x in args]
            wrong = [f"arg{i} is {format_spec(x)} but the jaxpr takes {format_spec(aval)}"
                     for i, (x, aval) in enumerate(zip(given, avals))
                     if hasattr(aval, "shape") and (x.shape, x.dtype) != (aval.shape, aval.dtype)]
            if wrong:
                raise UsageError(f"{resolved.name} is a jaxpr: {'; '.join(wrong)}")
            return run(*args)

        jaxpr_fn.__name__ = jaxpr_fn.__qualname__ = resolved.name.rsplit(".", 1)[-1]
        jaxpr_fn.__signature__ = inspect.Signature([
            inspect.Parameter(f"arg{i}", inspect.Parameter.POSITIONAL_ONLY,
                              annotation=jax.ShapeDtypeStruct(aval.shape, aval.dtype)
                              if hasattr(aval, "shape") else inspect.Parameter.empty)
            for i, aval in enumerate(obj.in_avals)])
        return jaxpr_fn
    if not callable(obj):
        raise LoadError(f"{resolved.name} is not callable (it is a {type(obj).__name__} object)")
    return obj


# --- parameters and arguments -------------------------------------------------------------------


def _namespace(fn) -> dict:
    """The globals that ``fn``'s string annotations refer to (for a callable object, its ``__call__``'s)."""
    inner = unwrap(fn)
    if not hasattr(inner, "__globals__"):
        inner = unwrap(getattr(type(inner), "__call__", None))
    return getattr(inner, "__globals__", {})


def _signature(fn) -> inspect.Signature:
    """``fn``'s signature (through wrappers), without the annotations of a function it transforms
    (see :func:`annotations_apply`)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: accept any positional arguments
        return inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])
    if annotations_apply(fn):
        return sig
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def annotations_apply(fn) -> bool:
    """Whether the annotations of the function behind ``fn`` (``inspect.signature`` follows
    partials, methods and ``__wrapped__``) describe ``fn`` itself.

    Not where a wrapper on the way computes something else: JAX's transformations that change types
    rewrite the docstring they copy (``jax.grad``: "Gradient of f ...", ``jax.vmap``: "Vectorized
    version of f ...", ``value_and_grad``, ``jacfwd``, ``jacrev``, ``hessian``), and ``jax.pmap``
    (a Python function with a ``lower`` method, unlike ``jax.jit``'s object) maps a leading axis.
    ``jax.jit``, ``jax.checkpoint``, ``custom_jvp``/``custom_vjp`` and ``functools.wraps`` keep both.
    """
    chain = wrapper_chain(fn)
    for outer, inner in zip(chain, chain[1:]):
        if getattr(outer, "__wrapped__", None) is not inner:  # a partial's function, a method's
            continue
        rewritten = (outer.__doc__ or "") != (inner.__doc__ or "")  # (jax.jit of no docstring: "")
        if rewritten or (isinstance(outer, types.FunctionType) and hasattr(outer, "lower")):
            return False
    return True


def _parameters(sig: inspect.Signature, static: dict, name: str):
    """(positional parameters taking arrays, the ``*args`` parameter or None), checking ``static``."""
    params = sig.parameters
    has_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key in static:
        param = params.get(key)
        if param is None and not has_kwargs:
            raise UsageError(f"--static {key}: {name} has no parameter {key!r} "
                             f"(parameters: {', '.join(params) or 'none'})")
        if param is not None and param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UsageError(f"--static {key}: parameter {key!r} of {name} cannot be bound by name")
    for param in params.values():
        if param.kind == param.KEYWORD_ONLY and param.default is param.empty and param.name not in static:
            raise UsageError(f"parameter {param.name!r} of {name} is keyword-only; bind it with "
                             f"--static {param.name}=VALUE")
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in static]
    varargs = next((p for p in params.values() if p.kind == p.VAR_POSITIONAL), None)
    return positional, varargs


def _check_count(count: int, positional, varargs, name: str, given: str) -> None:
    """Raise :class:`UsageError` unless ``count`` arguments fit the parameters; ``given`` ends the message."""
    required = sum(p.default is p.empty for p in positional)
    if required <= count and (varargs is not None or count <= len(positional)):
        return
    listed = [p.name if p.default is p.empty else f"[{p.name}]" for p in positional]
    listed += [f"*{varargs.name}"] if varargs is not None else []
    if varargs is not None:
        expected = f"at least {required}"
    elif required == len(positional):
        expected = str(required)
    else:
        expected = f"{required} to {len(positional)}"
    plural = "" if expected == "1" else "s"
    raise UsageError(f"{name} takes {expected} array argument{plural} ({', '.join(listed) or 'none'}), but {given}")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _example_args(resolved: _Resolved):
    """(values, label) from a companion ``NAME_example_args`` or an ``example_args`` attribute, or None."""
    last = resolved.name.rsplit(".", 1)[-1]
    prefix = resolved.name[: -len(last)]
    candidates = []
    if resolved.parent is not None:
        candidates.append((resolved.parent, f"{last}_example_args", f"{prefix}{last}_example_args"))
    candidates.append((resolved.obj, "example_args", f"{resolved.name}.example_args"))
    for owner, attribute, label in candidates:
        try:
            value = getattr(owner, attribute, None)
        except Exception:
            value = None
        if value is None:
            continue
        if callable(value):
            try:
                value = value()
            except JaxtoolError:
                raise
            except Exception as exc:
                raise LoadError(f"{label}() raised {exception_message(exc)}",
                                location=location_of_exception(exc)) from exc
            label += "()"
        if not isinstance(value, (tuple, list)):
            raise UsageError(f"{label} must be a tuple of example arguments, not {type(value).__name__}")
        return list(value), label
    return None


def _refuse_pytree_parameters(resolved: _Resolved, positional, namespace: dict, path) -> None:
    """:class:`UsageError` where the target's example arguments, or else the annotation, make one of
    the ``positional`` parameters that ``--inputs`` gives a plain array a pytree (a dict of arrays):
    the user's code would fail on the array, far from the cause."""
    import jax

    example = _example_args(resolved)
    for n, param in enumerate(positional):
        if example is not None:
            value, label = (example[0][n] if n < len(example[0]) else None), example[1]
        else:
            try:
                value = spec_of_annotation(param.annotation, namespace) if param.annotation is not param.empty else None
            except SpecError:
                value = None
            label = "its annotation"
        if value is not None and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            raise UsageError(f"--inputs {path}: parameter {param.name!r} is a pytree in {label} "
                             f"({type(value).__name__}); --inputs supports plain array arguments only")


def _is_array_like(value) -> bool:
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(
        isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)) and not isinstance(leaf, bool)
        for leaf in leaves)


def _default_value(value):
    """An array-like default as arrays; Python numbers become the default float dtype."""
    import jax
    import jax.numpy as jnp

    def leaf(x):
        if isinstance(x, (int, float)):
            return jnp.asarray(float(x))
        return jnp.asarray(x)

    return jax.tree_util.tree_map(leaf, value)


def _infer(positional, namespace: dict, name: str):
    """Per-parameter inference (rule 2): (parameters used as array arguments, their values)."""
    chosen, values = [], []
    for param in positional:
        if param.default is not param.empty and _is_array_like(param.default):
            chosen.append(param)
            values.append(_default_value(param.default))
            continue
        problem = ""
        try:
            spec = spec_of_annotation(param.annotation, namespace) if param.annotation is not param.empty else None
        except SpecError as exc:
            spec, problem = None, f" from its annotation ({exc})"
        if spec is not None:
            chosen.append(param)
            values.append(spec)
        elif param.default is param.empty:
            raise UsageError(f"cannot infer inputs for parameter {param.name!r} of {name}{problem}; "
                             "give a spec such as 'f32[3]'")
    return chosen, values


def _realize(values, rng, concrete: bool):
    """Arguments from spec values: draw ``ShapeDtypeStruct`` leaves (when ``concrete``), numbers to arrays."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    drawn = set()

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            check_x64(x.dtype, format_spec(x))
            if not concrete:
                return x
            try:
                value = draw(x, rng)
            except (ValueError, MemoryError) as exc:  # a shape numpy cannot allocate
                raise UsageError(f"cannot draw values for spec {format_spec(x)!r}: {exception_message(exc)}") from None
            drawn.add(drawn_kind(x.dtype))
            return value
        if isinstance(x, (np.ndarray, np.generic, int, float, complex)):
            return jnp.asarray(x)
        return x

    realized = [jax.tree_util.tree_map(leaf, value) for value in values]
    return realized, tuple(k for k in DRAWN_KINDS if k in drawn)


def _read_inputs(path, specs: list) -> tuple[list, tuple]:
    """Arrays ``arg0``, ``arg1``, ... from an ``.npz`` file, checked against ``specs`` when given,
    and the names of those that 64-bit mode being off narrows (see :attr:`Loaded.narrowed`)."""
    import zipfile

    import jax.numpy as jnp
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise UsageError(f"--inputs {path}: not an .npz file (save arrays with numpy.savez)")
        with data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise UsageError(f"--inputs {path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if os.path.isfile(path) and not zipfile.is_zipfile(path):  # (numpy reads any other file as a pickle)
            raise UsageError(f"--inputs {path}: not an .npz file (save arrays with numpy.savez)") from None
        raise UsageError(f"--inputs {path}: cannot read it as an .npz file ({exception_message(exc)})") from None
    count = len(specs) if specs else len(arrays)
    expected = [f"arg{i}" for i in range(count)]
    missing = [key for key in expected if key not in arrays]
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
                   ([f"unexpected {', '.join(extra)}"] if extra else [])
        raise UsageError(f"--inputs {path}: {'; '.join(problems)} (expected arrays arg0..arg{count - 1}, "
                         "one per argument)")
    values, narrowed = [], []
    for i, key in enumerate(expected):
        array = arrays[key]
        if not isinstance(array, np.ndarray):  # a member that is not an .npy file: its bytes
            raise UsageError(f"--inputs {path}: {key} is not a NumPy array (save arrays with numpy.savez)")
        if array.dtype.kind not in "biufc":
            raise UsageError(f"--inputs {path}: {key} has dtype {array.dtype} (expected numbers or booleans)")
        if specs:
            spec = specs[i]
            if not (hasattr(spec, "shape") and hasattr(spec, "dtype")):
                raise UsageError(f"--inputs {path}: argument {i} has a pytree spec; --inputs supports plain "
                                 "array arguments only")
            if tuple(array.shape) != tuple(spec.shape):
                raise UsageError(f"--inputs {path}: {key} is {format_spec(array)} but its spec is "
                                 f"{format_spec(spec)}")
            have, want = _number_kind(array.dtype), _number_kind(spec.dtype)
            if have > want:  # a lossy conversion: f64 data for an i32 argument
                loss = ("save booleans for a boolean argument" if want == 0 else
                        f"converting would drop its {'imaginary parts' if have == 3 else 'fractions'}")
                raise UsageError(f"--inputs {path}: {key} is {format_spec(array)} but its spec is "
                                 f"{format_spec(spec)}; {loss}")
            values.append(jnp.asarray(array, dtype=spec.dtype))
        else:
            values.append(jnp.asarray(array))
            if values[-1].dtype.itemsize < array.dtype.itemsize:
                narrowed.append(f"{key} ({format_spec(array)})")
    return values, tuple(narrowed)


def _number_kind(dtype) -> int:
    """0 boolean, 1 integer, 2 real floating point, 3 complex: an ``--inputs`` array converts to
    its spec's dtype only where this does not decrease (float64 to float32 is fine, float to int not)."""
    import jax.numpy as jnp

    categories = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)
    return next(kind for kind, category in enumerate(categories) if jnp.issubdtype(dtype, category))


def _bind(fn, sig: inspect.Signature, chosen, varargs, static: dict, name: str) -> Callable:
    """A function of exactly the array arguments, positionally, with ``static`` bound by name.

    Returns ``fn`` itself when the array arguments are a prefix of its positional parameters
    and nothing is static.
    """
    positional_all = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not static and [p.name for p in chosen] == [p.name for p in positional_all[:len(chosen)]]:
        return fn
    if varargs is not None and any(p.name in static for p in positional_all):
        raise UsageError(f"{name}: extra *{varargs.name} arguments cannot be combined with --static for a "
                         "positional parameter")
    chosen_names = [p.name for p in chosen]
    positional_only = [p for p in positional_all if p.kind == p.POSITIONAL_ONLY]

    def bound(*arrays):
        if len(arrays) > len(chosen_names):  # extra *args: everything by position
            return fn(*arrays, **static)
        given = dict(zip(chosen_names, arrays))
        head = [given.pop(p.name) if p.name in given else p.default for p in positional_only]
        return fn(*head, **static, **given)

    bound.__name__ = getattr(fn, "__name__", name)
    bound.__qualname__ = getattr(fn, "__qualname__", name)
    bound.__doc__ = getattr(fn, "__doc__", None)
    bound.__wrapped__ = fn
    params = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_ONLY, annotation=p.annotation) for p in chosen]
    if varargs is not None:
        params.append(inspect.Parameter(varargs.name, inspect.Parameter.VAR_POSITIONAL))
    bound.__signature__ = inspect.Signature(params)
    return bound


def _annotations(sig: inspect.Signature, namespace: dict) -> dict:
    """Parameter (and ``"return"``) annotations that are specs or jaxtyping annotations."""
    raw = {p.name: p.annotation for p in sig.parameters.values() if p.annotation is not p.empty}
    if sig.return_annotation is not sig.empty:
        raw["return"] = sig.return_annotation
    result = {}
    for key, annotation in raw.items():
        try:
            value = resolve_annotation(annotation, namespace)
        except SpecError:
            continue
        if value is not None:
            result[key] = value
    return result
