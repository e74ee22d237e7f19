"""Jaxprs as text for ``jaxtool show``: a printable view of a jaxpr, its rich rendering and a summary.

:func:`build_view` turns a closed jaxpr into a :class:`JaxprView` tree, the one description that the
text printer here and the JSON and DOT exporters (:mod:`jaxtool.export`) all read:

* variables are named as JAX's printer names them (``a``, ``b``, ..., ``z``, ``ba``, ...; one naming
  for the whole tree; the body of a ``jit``/``custom_jvp_call``-like call reuses the caller's names);
* each equation carries the parameters JAX's printer shows (``jit``'s default shardings, a
  ``broadcast_in_dim``'s ``shape`` and similar redundant ones left out), all its raw parameters,
  its user source location and the vertex numbers of its results (:mod:`jaxtool.graph`'s numbering);
* nested jaxprs (``jit``, ``cond`` branches, ``while`` cond/body, ``scan`` body, custom derivatives,
  ``remat``) are nested views, or folded to an equation count below a depth limit.

:func:`build_flat_view` does the same for the inlined program of :func:`jaxtool.graph.flatten`: inputs
are ``x0, x1, ...``, array constants ``c0, ...`` and results are named by their vertex number
(``v12``). :func:`render` draws either view with rich styles; :func:`summarize` and
:func:`render_summary` describe inputs, outputs and equation counts.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.text import Text

import jax
import jax.extend.core as jcore

from jaxtool.graph import INLINED, Const, FlatProgram, Input

#: Call primitives whose body takes its arguments one to one, so the body reuses the caller's names.
_SAME_NAMES = INLINED | {"custom_jvp_call", "custom_vjp_call"}

#: Rich styles of the parts of a jaxpr.
STYLES = {
    "keyword": "bold",
    "primitive": "bold cyan",
    "binder": "green",
    "var": "",
    "literal": "bright_blue",
    "type": "yellow",
    "param": "magenta",
    "value": "blue",
    "vertex": "bright_black",
    "source": "dim italic",
    "fold": "dim",
}


# ----------------------------------------------------------------------------------------- view


@dataclass(frozen=True)
class Atom:
    """A variable or literal as printed.

    ``key`` identifies the value inside one printed jaxpr (equal keys: the same value; exporters
    use it for graph nodes); it is ``None`` for literals, whose ``value`` is then set.
    """

    name: str
    aval: Any
    key: int | None
    value: Any = None

    @property
    def is_literal(self) -> bool:
        return self.key is None

    @property
    def type(self) -> str:
        """The short type, as JAX prints it: ``f32[3,4]``."""
        return short_type(self.aval)


@dataclass(frozen=True)
class SourceRef:
    """Where the user's code created an equation."""

    file: str
    line: int
    function: str
    code: str

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Nested:
    """A jaxpr held in the parameter ``param`` (item ``index`` of a tuple such as ``branches``).

    ``view`` is ``None`` when the jaxpr is folded; ``num_eqns`` counts its equations, nested ones
    included.
    """

    param: str
    index: int | None
    view: JaxprView | None
    num_eqns: int

    @property
    def label(self) -> str:
        return self.param if self.index is None else f"{self.param}[{self.index}]"


@dataclass
class EqnView:
    """One equation: what JAX's printer shows, plus source, vertices and nested jaxprs."""

    path: tuple
    primitive: str
    shown: list  # [(name, text)]: the simple parameters JAX's printer shows, in its order
    params: dict  # every parameter, raw (jaxpr-valued ones are in ``nested``)
    invars: list  # [Atom]
    outvars: list  # [Atom]
    nested: list  # [Nested]
    vertices: tuple | None  # vertex number of each result (None: an input passed through)
    source: SourceRef | None


@dataclass
class JaxprView:
    """A jaxpr as printed: binders and outputs as :class:`Atom`, equations as :class:`EqnView`."""

    constvars: list
    invars: list
    eqns: list
    outvars: list
    inline: bool = False  # a view of the inlined (flat) program
    num_vertices: int | None = None  # of the whole program (top-level view only)


def short_type(aval) -> str:
    """``f32[3,4]`` for a shaped aval; ``str(aval)`` for others (tokens, refs)."""
    try:
        return aval.str_short(short_dtypes=True)
    except (AttributeError, TypeError):
        return str(aval)


def aval_bytes(aval) -> int:
    """The size in bytes of a value of type ``aval`` (0 where it has no shape and dtype)."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    # (a JAX extended dtype, such as a typed PRNG key's ``key<fry>``, is no NumPy dtype but has an itemsize)
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _alphabetic(n: int) -> str:
    """JAX's variable names: 0 -> a, 25 -> z, 26 -> ba, ..."""
    name = ""
    while not name or n:
        n, digit = divmod(n, 26)
        name = chr(97 + digit) + name
    return name


class Namer:
    """Names variables in order of first appearance, as JAX's printer does."""

    def __init__(self):
        self.names: dict = {}
        self._count = 0

    def __call__(self, var) -> str:
        if isinstance(var, jcore.DropVar):
            return "_"
        if var not in self.names:
            self.names[var] = _alphabetic(self._count)
            self._count += 1
        return self.names[var]

    def suggest(self, inner, outer) -> None:
        """Give the binders ``inner`` of a call body the names of the caller's atoms ``outer``."""
        if len(inner) != len(outer):
            return
        used = set()
        for var, like in zip(inner, outer):
            if (isinstance(like, jcore.Var) and not isinstance(like, jcore.DropVar) and like not in used
                    and isinstance(var, jcore.Var) and not isinstance(var, jcore.DropVar)
                    and var not in self.names):
                used.add(like)
                self.names[var] = self(like)


def literal_text(value) -> str:
    """A literal's value as printed: ``2.0``, ``1``, ``True``; arrays as nested lists."""
    array = np.asarray(value)
    return str(array.item() if array.ndim == 0 else array.tolist())


# ----------------------------------------------------------------------------- parameters


_JAXPRS = (jcore.Jaxpr, jcore.ClosedJaxpr)


def is_jaxpr_param(value) -> bool:
    """Whether a parameter holds a jaxpr or a tuple of jaxprs (as JAX's printer nests them), some of
    which may be None: ``custom_linear_solve``'s ``jaxprs`` is a NamedTuple of four, ``vecmat`` and
    ``transpose_solve`` None where not needed."""
    return isinstance(value, _JAXPRS) or (isinstance(value, tuple) and any(isinstance(j, _JAXPRS) for j in value)
                                          and all(j is None or isinstance(j, _JAXPRS) for j in value))


def subjaxprs(params: dict) -> list:
    """The jaxprs in ``params``: ``[(param, index or None, Jaxpr)]`` in parameter order."""
    found = []
    for key in sorted(params):
        value = params[key]
        if isinstance(value, _JAXPRS):
            found.append((key, None, _open(value)))
        elif is_jaxpr_param(value):
            found.extend((key, i, _open(j)) for i, j in enumerate(value) if j is not None)
    return found


def _open(jaxpr):
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


def function_name(value) -> str | None:
    """The name of a function-valued parameter (a plain function or JAX's wrapped function)."""
    info = getattr(value, "debug_info", None)
    if info is not None and getattr(info, "func_name", None):
        return info.func_name
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return None


_ADDRESS = re.compile(r" at 0x([0-9a-fA-F]+)")


def param_text(value) -> str:
    """A parameter value as JAX's printer writes it (addresses masked, functions by name)."""
    if isinstance(value, frozenset):
        return f"frozenset({{{', '.join(repr(e) for e in sorted(value))}}})"
    name = function_name(value)
    if name is not None:
        return name
    try:
        text = str(value)
    except Exception as exc:  # noqa: BLE001 - a user primitive's parameter whose repr raises
        text = f"<{type(value).__name__}: str() raised {type(exc).__name__}>"
    return _ADDRESS.sub(lambda m: " at 0x" + "X" * len(m.group(1)), text)


def _all_default(values, default_text) -> bool:
    return all(str(v) == default_text for v in values)


def shown_params(primitive: str, params: dict) -> list:
    """The simple (non-jaxpr) parameters JAX's printer shows for an equation, as ``[(name, text)]``.

    Mirrors the custom printing rules of JAX 0.10: defaults of ``jit`` hidden, ``shape``/``sharding``
    implied by the result type hidden, ``None`` accuracy and output dtypes hidden, custom-derivative
    rules shown by function name, and ``name`` first.
    """
    p = {k: v for k, v in params.items() if not is_jaxpr_param(v)}
    first = []
    if primitive == "jit":
        p.pop("inline", None)
        for key, default in (("donated_invars", "False"), ("in_shardings", "UnspecifiedValue"),
                             ("out_shardings", "UnspecifiedValue"), ("in_layouts", "None"),
                             ("out_layouts", "None")):
            if key in p and _all_default(p[key], default):
                del p[key]
        if not p.get("keep_unused", True):
            del p["keep_unused"]
        if getattr(p.get("ctx_mesh"), "empty", False):
            del p["ctx_mesh"]
        if "compiler_options_kvs" in p and not p["compiler_options_kvs"]:
            del p["compiler_options_kvs"]
    elif primitive in ("custom_jvp_call", "custom_vjp_call"):
        if not p.get("num_consts"):
            p.pop("num_consts", None)
        p.pop("out_trees", None)
        for raw, short in (("jvp_jaxpr_fun", "jvp"), ("fwd_jaxpr_thunk", "fwd")):
            if raw in p:
                p[short] = p.pop(raw)
        info = getattr(_open(params["call_jaxpr"]), "debug_info", None) if "call_jaxpr" in params else None
        name = getattr(info, "func_name", None)
        if name:
            first = [("name", name)]
    elif primitive == "dot_general":
        p = {k: v for k, v in p.items() if v is not None and k != "out_sharding"}
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        p["dimension_numbers"] = ((list(lc), list(rc)), (list(lb), list(rb)))
    elif primitive == "broadcast_in_dim":
        p.pop("shape", None)
        p.pop("sharding", None)
        if not p.get("broadcast_dimensions", True):
            del p["broadcast_dimensions"]
    elif primitive == "convert_element_type":
        p.pop("sharding", None)
    if "accuracy" in p and p["accuracy"] is None:
        del p["accuracy"]
    if "out_dtype" in p and p["out_dtype"] is None:
        del p["out_dtype"]
    if "name" in p:
        first = [("name", p.pop("name"))]
    return [(k, param_text(v)) for k, v in first + sorted(p.items())]


# ------------------------------------------------------------------------------- counting


def count_primitives(jaxpr) -> Counter:
    """Equations by primitive name, those of nested jaxprs included (a call counts once itself), of
    a jaxpr or an inlined :class:`~jaxtool.graph.FlatProgram`."""
    counts = Counter()
    for eqn in _open(jaxpr).eqns:
        counts[eqn.primitive.name] += 1
        for _, _, sub in subjaxprs(eqn.params):
            counts.update(count_primitives(sub))
    return counts


def result_vertices(closed_jaxpr, program: FlatProgram) -> dict:
    """The vertex numbers of each equation's results, by equation path, for every equation that
    :func:`jaxtool.graph.flatten` numbers or inlines.

    Inlined calls (``jit``, ``closed_call``, ``remat``) get the vertices their body's results
    resolve to; ``None`` marks a result that is an input or a constant rather than a vertex.
    """
    by_path = program.vertices_by_path()
    found: dict = {}

    def walk(jaxpr, env: dict, path: tuple) -> list:
        for index, eqn in enumerate(jaxpr.eqns):
            here = path + (index,)
            if eqn.primitive.name in INLINED:
                body = _open(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
                inner = {v: _lookup(env, a) for v, a in zip(body.invars, eqn.invars)}
                numbers = tuple(walk(body, inner, here))
            else:
                numbers = tuple(by_path.get(here, ()))
            found[here] = numbers
            env.update(zip(eqn.outvars, numbers))
        return [_lookup(env, v) for v in jaxpr.outvars]

    walk(_open(closed_jaxpr), {}, ())
    return found


def _lookup(env: dict, atom):
    return None if isinstance(atom, jcore.Literal) else env.get(atom)


# ------------------------------------------------------------------------------- source


def source_ref(source_info) -> SourceRef | None:
    """The user's frame that created an equation, with its line of code (``None`` if unknown)."""
    from jaxtool import source

    frame = source.user_frame(source_info)
    if frame is None:
        return None
    return SourceRef(file=source.display_path(frame.file_name), line=frame.line_num,
                     function=frame.function_name, code=source.source_line(frame))


# ------------------------------------------------------------------------------- building


class _Builder:
    """Builds views, naming variables once for the whole tree."""

    def __init__(self, *, depth: int | None, with_source: bool):
        self.depth = depth
        self.with_source = with_source
        self.namer = Namer()
        self._keys = 0

    def key(self) -> int:
        self._keys += 1
        return self._keys

    def jaxpr(self, jaxpr, level: int, path: tuple, vertices: dict | None) -> JaxprView:
        """A view of ``jaxpr``; ``vertices`` (from :func:`result_vertices`) is given only on the
        chain of inlined calls from the top, where equation paths are those of the flat program."""
        keys: dict = {}

        def binder(var) -> Atom:
            keys[var] = self.key()
            return Atom(self.namer(var), var.aval, keys[var])

        def use(atom) -> Atom:
            if isinstance(atom, jcore.Literal):
                return Atom(literal_text(atom.val), atom.aval, None, atom.val)
            if atom not in keys:  # not bound in this jaxpr (an ill-formed one): give it a node anyway
                keys[atom] = self.key()
            return Atom(self.namer(atom), atom.aval, keys[atom])

        constvars = [binder(v) for v in jaxpr.constvars]
        invars = [binder(v) for v in jaxpr.invars]
        eqns = []
        for index, eqn in enumerate(jaxpr.eqns):
            here = path + (index,)
            name = eqn.primitive.name
            subs = subjaxprs(eqn.params)
            if name in _SAME_NAMES and len(subs) == 1:
                self.namer.suggest(subs[0][2].invars, eqn.invars)
                self.namer.suggest(subs[0][2].outvars, eqn.outvars)
            outvars = [binder(v) for v in eqn.outvars]
            inputs = [use(v) for v in eqn.invars]
            inner_vertices = vertices if name in INLINED else None
            nested = [self.nested(param, i, sub, level + 1, here, inner_vertices) for param, i, sub in subs]
            eqns.append(EqnView(
                path=here, primitive=name, shown=shown_params(name, eqn.params), params=dict(eqn.params),
                invars=inputs, outvars=outvars, nested=nested,
                vertices=vertices.get(here) if vertices is not None else None,
                source=source_ref(eqn.source_info) if self.with_source else None))
        outvars = [use(v) for v in jaxpr.outvars]
        return JaxprView(constvars, invars, eqns, outvars)

    def nested(self, param, index, jaxpr, level, path, vertices) -> Nested:
        count = sum(count_primitives(jaxpr).values())
        if self.depth is not None and level > self.depth:
            return Nested(param, index, None, count)
        return Nested(param, index, self.jaxpr(jaxpr, level, path, vertices), count)


def build_view(closed_jaxpr, *, program: FlatProgram | None = None, depth: int | None = None,
               source: bool = True) -> JaxprView:
    """A view of ``closed_jaxpr`` (a ClosedJaxpr or Jaxpr), nested jaxprs folded beyond ``depth``.

    With ``program`` (``graph.flatten(closed_jaxpr)``) equations carry their vertex numbers; with
    ``source`` their user source location.
    """
    vertices = result_vertices(closed_jaxpr, program) if program is not None else None
    builder = _Builder(depth=depth, with_source=source)
    view = builder.jaxpr(_open(closed_jaxpr), 0, (), vertices)
    if program is not None:
        view.num_vertices = program.num_vertices
    return view


def build_flat_view(program: FlatProgram, *, depth: int | None = None, source: bool = True) -> JaxprView:
    """A view of the inlined program: inputs ``x0...``, array constants ``c0...``, results ``v1...``.

    Control flow and custom derivatives stay opaque equations; their jaxprs are nested views.
    """
    builder = _Builder(depth=depth, with_source=source)
    invars = [Atom(f"x{i}", aval, builder.key()) for i, aval in enumerate(program.in_avals)]
    consts: dict = {}  # id(value) -> Atom
    vertex_atoms: dict = {}

    def atom(a) -> Atom:
        if isinstance(a, Input):
            return invars[a.index]
        if isinstance(a, Const):
            if np.ndim(a.value) == 0:
                return Atom(literal_text(a.value), jax.typeof(a.value), None, a.value)
            if id(a.value) not in consts:
                consts[id(a.value)] = Atom(f"c{len(consts)}", jax.typeof(a.value), builder.key(), a.value)
            return consts[id(a.value)]
        if a not in vertex_atoms:
            vertex_atoms[a] = Atom(f"v{a}", program.avals[a], builder.key())
        return vertex_atoms[a]

    eqns = []
    for eqn in program.eqns:
        inputs = [atom(a) for a in eqn.invars]
        outvars = [atom(n) for n in eqn.outvars]
        nested = [builder.nested(param, i, sub, 1, eqn.path, None) for param, i, sub in subjaxprs(eqn.params)]
        eqns.append(EqnView(
            path=eqn.path, primitive=eqn.name, shown=shown_params(eqn.name, eqn.params), params=dict(eqn.params),
            invars=inputs, outvars=outvars, nested=nested, vertices=tuple(eqn.outvars),
            source=source_ref(eqn.user_source_info()) if source else None))
    outvars = [atom(a) for a in program.outvars]
    return JaxprView(list(consts.values()), invars, eqns, outvars, inline=True,
                     num_vertices=program.num_vertices)


# ------------------------------------------------------------------------------- rendering


def _styled(text: str, role: str) -> Text:
    return Text(text, style=STYLES[role])


def _join(*parts) -> Text:
    """Concatenate strings and styled texts, each keeping its own style."""
    out = Text()
    for part in parts:
        if isinstance(part, str):
            out.append(part)
        else:
            out.append_text(part)
    return out


def _binders(atoms) -> Text:
    out = Text()
    for i, a in enumerate(atoms):
        if i:
            out.append(" ")
        out.append(a.name, STYLES["binder"])
        out.append(":" + a.type, STYLES["type"])
    return out


def _uses(atoms, sep: str = " ") -> Text:
    out = Text()
    for i, a in enumerate(atoms):
        if i:
            out.append(sep)
        if a.is_literal:
            out.append(a.name, STYLES["literal"])
            out.append(":" + a.type, STYLES["type"])
        else:
            out.append(a.name, STYLES["var"])
    return out


def vertex_label(vertices) -> str:
    """``v9,v10`` for an equation's result vertices; ``-`` marks a result that is no vertex (an
    input or constant passed through a call); empty where the equation has no numbering."""
    return ",".join("-" if n is None else f"v{n}" for n in vertices or ())


class _Lines:
    """Lines of output: ``(vertex label, body, source note)``."""

    def __init__(self, *, source: bool):
        self.source = source
        self.rows: list = []

    def add(self, indent: int, body: Text, label: str = "", note: SourceRef | None = None) -> None:
        self.rows.append((label, _join(" " * indent, body), note))

    def jaxpr(self, view: JaxprView, indent: int, prefix: Text) -> None:
        self.add(indent, _join(prefix, _styled("{ lambda ", "keyword"), _binders(view.constvars), "; ",
                               _binders(view.invars), ". ", _styled("let", "keyword")))
        for eqn in view.eqns:
            self.eqn(eqn, indent + 4, labelled=not view.inline)
        self.add(indent + 2, _join(_styled("in ", "keyword"), "(", _uses(view.outvars, ", "),
                                   ",)" if len(view.outvars) == 1 else ")", _styled(" }", "keyword")))

    def eqn(self, eqn: EqnView, indent: int, labelled: bool) -> None:
        body = _join(_binders(eqn.outvars), " = ") if eqn.outvars else Text()
        body.append(eqn.primitive, STYLES["primitive"])
        if eqn.shown:
            body.append("[")
            for i, (key, value) in enumerate(eqn.shown):
                if i:
                    body.append(" ")
                body.append(key, STYLES["param"])
                body.append("=")
                body.append(value, STYLES["value"])
            body.append("]")
        if eqn.invars:
            body.append(" ")
            body.append_text(_uses(eqn.invars))
        label = vertex_label(eqn.vertices) if labelled else ""
        self.add(indent, body, label, eqn.source if self.source else None)
        for nested in eqn.nested:
            prefix = _join(_styled(nested.label, "param"), "=")
            if nested.view is None:
                s = "" if nested.num_eqns == 1 else "s"
                self.add(indent + 2, _join(prefix, _styled(f"{{ ... {nested.num_eqns} eqn{s} }}", "fold")))
            else:
                self.jaxpr(nested.view, indent + 2, prefix)

    def text(self, *, labels: bool) -> Text:
        width = max((len(label) for label, _, _ in self.rows), default=0) if labels else 0
        noted = [body.cell_len for _, body, note in self.rows if note is not None]
        note_col = min(max(noted, default=0), 100) + 2
        out = Text()
        for i, (label, body, note) in enumerate(self.rows):
            if i:
                out.append("\n")
            if labels:
                out.append(label.ljust(width), STYLES["vertex"])
                out.append("  ")
            out.append_text(body)
            if note is not None:
                out.append(" " * max(note_col - body.cell_len, 2))
                out.append(f"# {note.location}  {note.code}".rstrip(), STYLES["source"])
        return out


def render(view: JaxprView, *, vertices: bool = False, source: bool = False) -> Text:
    """The jaxpr as styled text: JAX's notation, nested jaxprs indented under their equation.

    ``vertices`` adds a left column with each equation's result vertices (``v9,v10``); an inlined
    view names its results by vertex already. ``source`` appends ``# file:line  code`` to each
    equation that has a user source location.
    """
    lines = _Lines(source=source)
    lines.jaxpr(view, 0, Text())
    return lines.text(labels=vertices and not view.inline)


# ------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Port:
    """An input or output of the program."""

    name: str
    var: str
    type: str
    shape: tuple
    dtype: str
    bytes: int


@dataclass(frozen=True)
class Summary:
    inputs: list
    outputs: list
    counts: dict  # primitive -> number of equations, nested included; most frequent first
    total: int
    num_vertices: int | None


def _ports(atoms, names) -> list:
    names = list(names) if names is not None and len(names) == len(atoms) else None
    ports = []
    for i, a in enumerate(atoms):
        dtype = getattr(a.aval, "dtype", None)
        ports.append(Port(name=names[i] if names else f"[{i}]", var=a.name, type=a.type,
                          shape=tuple(getattr(a.aval, "shape", ())), dtype=str(dtype) if dtype is not None else "",
                          bytes=aval_bytes(a.aval)))
    return ports


def summarize(program, view: JaxprView, *, in_names=None, out_names=None) -> Summary:
    """Inputs and outputs (named by ``in_names``/``out_names`` when given) and the equation counts
    of ``program``, a jaxpr or its inlined :class:`~jaxtool.graph.FlatProgram`."""
    counts = count_primitives(program)
    ordered = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return Summary(inputs=_ports(view.invars, in_names), outputs=_ports(view.outvars, out_names),
                   counts=ordered, total=sum(counts.values()), num_vertices=view.num_vertices)


def render_summary(summary: Summary) -> Text:
    """The summary as aligned text: inputs, outputs, then equation counts by primitive."""
    out = Text()
    for title, ports in (("inputs", summary.inputs), ("outputs", summary.outputs)):
        total = sum(p.bytes for p in ports)
        out.append(f"{title}: {len(ports)}, {total:,} bytes\n", STYLES["keyword"])
        name_w = max((len(p.name) for p in ports), default=0)
        var_w = max((len(p.var) for p in ports), default=0)
        type_w = max((len(p.type) for p in ports), default=0)
        bytes_w = max((len(f"{p.bytes:,}") for p in ports), default=0)
        for p in ports:
            out.append(f"  {p.name.ljust(name_w)}  ")
            out.append(p.var.ljust(var_w), STYLES["binder"])
            out.append("  ")
            out.append(p.type.ljust(type_w), STYLES["type"])
            out.append(f"  {p.bytes:>{bytes_w},} B\n")
    vertices = f", {summary.num_vertices} vertices" if summary.num_vertices is not None else ""
    out.append(f"equations: {summary.total} (nested included){vertices}\n", STYLES["keyword"])
    prim_w = max((len(name) for name in summary.counts), default=0)
    for name, count in summary.counts.items():
        out.append("  ")
        out.append(name.ljust(prim_w), STYLES["primitive"])
        out.append(f"  {count}\n")
    out.rstrip()
    return out
