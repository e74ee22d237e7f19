"""Input specifications: aval strings, pytree JSON, ``--static`` values, annotations, drawn values.

An *aval string* is written the way JAX prints abstract values: ``DTYPE[DIMS]`` with a
short dtype name and comma-separated non-negative sizes, e.g. ``f32[32,64]``, ``i32[]``
(a scalar), ``bf16[8]``, ``bool[]``, ``c64[2]``. Short names are the ones JAX prints:
``f16 bf16 f32 f64 i8 i16 i32 i64 u8 u16 u32 u64 bool c64 c128`` (and the other JAX dtypes
spelled the same way, e.g. ``f8_e4m3fn``). 64-bit dtypes need ``jax_enable_x64`` (``--x64``).

A *spec* is an aval string or a JSON object/list whose leaves are aval strings, e.g.
``{"w": "f32[8,4]", "b": "f32[4]"}`` or ``["f32[3]", {"a": "f32[]"}]``; it parses to a
``jax.ShapeDtypeStruct`` or a pytree (dicts, lists) of them.

JAX is imported inside the functions that need it, never at import time.
"""

from __future__ import annotations

import ast
import json
import re

from jaxtool.errors import SpecError

EXPECTED = "expected DTYPE[DIMS] such as 'f32[3,4]' or 'i32[]', or a JSON object/list of them"

_AVAL = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*\[([^\[\]]*)\]\s*$")
_DTYPE_TOKEN = re.compile(r"^(bool|(bf|f|u|i|c)[0-9][a-z0-9_]*)$")
_PREFIXES = (("bf", "bfloat"), ("f", "float"), ("u", "uint"), ("i", "int"), ("c", "complex"))


def short_dtype(dtype) -> str:
    """The short name JAX prints for ``dtype``: ``float32`` -> ``f32``, ``bfloat16`` -> ``bf16``."""
    import numpy as np

    name = np.dtype(dtype).name
    for short, long in _PREFIXES:
        if name.startswith(long):
            return short + name[len(long):]
    return name


def format_spec(struct) -> str:
    """The aval string of anything with ``shape`` and ``dtype``: ``f32[3,4]``."""
    return f"{short_dtype(struct.dtype)}[{','.join(str(d) for d in struct.shape)}]"


def looks_like_spec(text: str) -> bool:
    """Whether ``text`` is shaped like a spec (an aval string or JSON), valid or not."""
    stripped = text.strip()
    match = _AVAL.match(stripped)
    return bool(match and _DTYPE_TOKEN.match(match.group(1))) or stripped[:1] in ("{", "[")


def x64_enabled() -> bool:
    """Whether JAX's 64-bit mode (``jax_enable_x64``) is on."""
    import jax

    return bool(jax.config.read("jax_enable_x64"))


def check_x64(dtype, text: str) -> None:
    """Raise :class:`SpecError` for a 64-bit ``dtype`` (f64, i64, u64, c128) while 64-bit mode is off."""
    import numpy as np

    dtype = np.dtype(dtype)
    wide = dtype.itemsize == (16 if dtype.kind == "c" else 8) and dtype.kind in "fiuc"
    if wide and not x64_enabled():
        raise SpecError(f"bad spec {text!r}: {short_dtype(dtype)} needs 64-bit mode; pass --x64 "
                        "(Python API: jax.config.update('jax_enable_x64', True))")


def _parse_dtype(token: str, text: str):
    """The dtype a short name denotes (``f32``, ``bf16``, ``bool``, ``f8_e4m3fn``); JAX must be imported."""
    import numpy as np

    if _DTYPE_TOKEN.match(token):
        long_name = next((long + token[len(short):] for short, long in _PREFIXES if token.startswith(short)), token)
        try:
            dtype = np.dtype(long_name)
        except TypeError:
            dtype = None
        if dtype is not None and short_dtype(dtype) == token:
            return dtype
    raise SpecError(f"bad spec {text!r}: unknown dtype {token!r} (use f32, bf16, f16, f64, i8, i16, i32, i64, "
                    f"u8, u32, bool, c64, ...); {EXPECTED}")


def parse_aval(text: str):
    """Parse one aval string such as ``f32[3,4]`` into a ``jax.ShapeDtypeStruct``.

    Raises :class:`SpecError` naming ``text`` and the expected form.
    """
    import jax

    match = _AVAL.match(text)
    if not match:
        raise SpecError(f"bad spec {text!r}: {EXPECTED}")
    token, dims_text = match.groups()
    dtype = _parse_dtype(token, text)
    dims = [d.strip() for d in dims_text.split(",")] if dims_text.strip() else []
    for dim in dims:
        if dim.isidentifier():
            raise SpecError(f"bad spec {text!r}: dimension {dim!r} is a name, not a size; {EXPECTED}")
        if not dim.isdigit():
            raise SpecError(f"bad spec {text!r}: dimension {dim!r} is not a non-negative integer; {EXPECTED}")
    check_x64(dtype, text)
    return jax.ShapeDtypeStruct(tuple(int(d) for d in dims), dtype)


def parse_spec(text: str):
    """Parse a spec: an aval string or a JSON object/list whose leaves are aval strings.

    Returns a ``jax.ShapeDtypeStruct`` or a pytree (dicts and lists; JSON ``null`` is ``None``)
    of them. Raises :class:`SpecError` quoting ``text`` and showing the expected form.
    """
    if not isinstance(text, str):
        raise SpecError(f"bad spec {text!r}: not a string; {EXPECTED}")
    if text.strip()[:1] not in ("{", "["):
        return parse_aval(text)
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"bad spec {text!r}: invalid JSON ({exc.msg} at column {exc.colno}); {EXPECTED}") from None

    def convert(node, path):
        if isinstance(node, str):
            return parse_aval(node)
        if isinstance(node, dict):
            return {key: convert(value, f"{path}[{json.dumps(key)}]") for key, value in node.items()}
        if isinstance(node, list):
            return [convert(value, f"{path}[{i}]") for i, value in enumerate(node)]
        if node is None:
            return None
        raise SpecError(f"bad spec {text!r}: leaf {json.dumps(node)} at {path or 'top level'} is not an aval "
                        f"string; {EXPECTED}")

    return convert(tree, "")


def parse_static(text: str) -> tuple[str, object]:
    """Parse ``--static NAME=VALUE``: VALUE as a Python literal (``ast.literal_eval``), else as a string.

    ``n=3`` -> ``("n", 3)``, ``shape=(2, 3)`` -> ``("shape", (2, 3))``, ``act=relu`` -> ``("act", "relu")``.
    """
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise SpecError(f"bad --static {text!r}: expected NAME=VALUE, e.g. --static n=3")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return name, value


def parse_statics(static) -> dict:
    """Normalise static arguments: a mapping as is, or ``NAME=VALUE`` strings (duplicates rejected)."""
    if static is None:
        return {}
    if hasattr(static, "items"):
        return dict(static)
    if isinstance(static, str):
        static = [static]
    if not isinstance(static, (list, tuple)) or not all(isinstance(text, str) for text in static):
        raise SpecError(f"bad static arguments {static!r}: expected a mapping of names to values, or "
                        "NAME=VALUE strings")
    result: dict = {}
    for text in static:
        name, value = parse_static(text)
        if name in result:
            raise SpecError(f"bad --static {text!r}: {name!r} is given twice")
        result[name] = value
    return result


def resolve_annotation(annotation, namespace: dict | None = None):
    """An annotation as jaxtool understands it, or ``None`` if it says nothing about shapes.

    Spec strings (``x: "f32[3,4]"``) become ``ShapeDtypeStruct`` pytrees; ``ShapeDtypeStruct``
    objects and jaxtyping annotations (``Float[Array, "3 4"]``) are returned as they are.
    Other strings (``from __future__ import annotations``) are evaluated in ``namespace``
    first. A spec-shaped string that does not parse raises :class:`SpecError`.
    """
    import jax

    if isinstance(annotation, str):
        if annotation[:1] in ("'", '"'):  # x: "f32[3]" under postponed annotations is the text '"f32[3]"'
            try:
                annotation = ast.literal_eval(annotation)
            except (ValueError, SyntaxError):
                return None
            if not isinstance(annotation, str):
                return None
        if looks_like_spec(annotation):
            return parse_spec(annotation)
        try:
            annotation = eval(annotation, namespace or {})  # the user's own annotation expression
        except Exception:
            return None
    if isinstance(annotation, jax.ShapeDtypeStruct) or is_jaxtyping(annotation):
        return annotation
    return None


def spec_of_annotation(annotation, namespace: dict | None = None):
    """The ``ShapeDtypeStruct`` (pytree) an annotation describes, or ``None`` (see :func:`resolve_annotation`).

    A jaxtyping annotation must have fixed sizes (``"3 4"``, not ``"batch 4"``) and gets the
    default dtype of its kind (f32/f64 for ``Float``, i32/i64 for ``Int``, ...), or where it
    names none of those, the first dtype it names that JAX holds (``Float16``, ``Int8``);
    otherwise :class:`SpecError` says what is missing.
    """
    resolved = resolve_annotation(annotation, namespace)
    return _jaxtyping_spec(resolved) if is_jaxtyping(resolved) else resolved


def is_jaxtyping(annotation) -> bool:
    """Whether ``annotation`` is a jaxtyping array annotation such as ``Float[Array, "3 4"]``."""
    return isinstance(annotation, type) and all(hasattr(annotation, a) for a in ("dtypes", "dims", "dim_str"))


def _jaxtyping_spec(annotation):
    import jax
    import jax.numpy as jnp

    shape = []
    for i, dim in enumerate(annotation.dims):
        size = getattr(dim, "size", None)
        if not isinstance(size, int) or getattr(dim, "broadcastable", False):
            raise SpecError(f"annotation {annotation.__name__}: dimension {i} of {annotation.dim_str!r} has no "
                            "fixed size")
        shape.append(size)
    dtypes = annotation.dtypes if isinstance(annotation.dtypes, (tuple, list)) else ()
    default_float = jnp.dtype(jnp.float64 if x64_enabled() else jnp.float32)
    default_int = jnp.dtype(jnp.int64 if x64_enabled() else jnp.int32)
    preferred = [default_float, default_int, jnp.dtype(jnp.uint32), jnp.dtype(bool), jnp.dtype(jnp.complex64)]
    names = set(dtypes)
    dtype = default_float if not names else next((d for d in preferred if d.name in names), None)
    if dtype is None:  # (Float16, Int8, Float32 under --x64: the first the annotation names that JAX holds)
        named = [d for d in map(_known_dtype, dtypes) if d is not None]
        dtype = next((d for d in named if jax.dtypes.canonicalize_dtype(d) == d), None)
        if dtype is None:
            wide = " (64-bit: pass --x64)" if named else ""
            raise SpecError(f"annotation {annotation.__name__}: no dtype to draw inputs of among "
                            f"{', '.join(sorted(names))}{wide}")
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _known_dtype(name: str):
    """The dtype ``name`` names (a jaxtyping dtype name), or None where JAX has none of that name."""
    import jax.numpy as jnp

    try:
        return jnp.dtype(name)
    except TypeError:
        return None


def drawn_kind(dtype) -> str | None:
    """The kind of values :func:`draw` draws for ``dtype``: "booleans", "integers", "complex" or
    "floats"; None for a dtype it cannot draw."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(bool):
        return "booleans"
    for kind, family in (("integers", jnp.integer), ("complex", jnp.complexfloating), ("floats", jnp.floating)):
        if jnp.issubdtype(dtype, family):
            return kind
    return None


def draw(tree, rng):
    """Concrete arrays for every ``ShapeDtypeStruct`` leaf of ``tree`` (other leaves kept as given).

    Values come from the numpy Generator ``rng``, leaf by leaf in pytree order: floats
    ~ N(0, 1), complex with N(0, 1) real and imaginary parts, integers uniform in [0, 10)
    (clipped to the dtype's range), booleans fair coin flips.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    def one(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        dtype, shape = jnp.dtype(leaf.dtype), leaf.shape
        check_x64(dtype, format_spec(leaf))
        kind = drawn_kind(dtype)
        if kind == "booleans":
            values = rng.random(shape) < 0.5
        elif kind == "integers":
            values = rng.integers(0, min(10, int(jnp.iinfo(dtype).max) + 1), shape)
        elif kind == "complex":
            values = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        elif kind == "floats":
            values = rng.standard_normal(shape)
        else:
            raise SpecError(f"cannot draw values of dtype {dtype.name} for {format_spec(leaf)}; give --inputs")
        return jnp.asarray(np.asarray(values).astype(dtype))  # convert on the host: no XLA compile per dtype

    return jax.tree_util.tree_map(one, tree)

